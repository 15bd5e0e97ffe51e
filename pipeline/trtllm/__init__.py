"""TensorRT-LLM's side, as facts this project can't run here: the releases it writes for and their containers (version),
the reference tables every flag, tensor name and launch step we emit cites (upstream: Triton and tensorrtllm_backend;
reference: trtllm-build and the LLM API), each naming the upstream file and symbol it follows."""
