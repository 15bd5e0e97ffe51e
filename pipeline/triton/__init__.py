"""Serving on Triton Inference Server: model repository configs and the tritonserver process."""
