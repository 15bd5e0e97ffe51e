"""How speculation is decided and bounded, without torch: the gate (per request and per step), its policy, the
draft planner and its cost model, the sampling limits, and the serving gate inside tritonserver. The engine, the
Triton configs and models, the compiler and the deploy planner import it; it imports only errors."""
