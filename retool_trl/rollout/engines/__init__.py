"""The engines a rollout drives, one module each: transformers `generate` (`transformers_generate`), TRL's vLLM helper
batched per turn (`vllm_batched`), the colocated vLLM engine request by request (`vllm_colocate`) and a vLLM server's
completions endpoint (`vllm_server`, over the HTTP client of `completions_http`). Importing this package imports none
of them (vLLM is optional)."""
