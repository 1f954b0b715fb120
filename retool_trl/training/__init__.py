"""What the trainer does with a rollout before and after TRL scores it: the `retool/*` metrics (`metrics`), where
each step's time goes (`stage_timings`, `stage_clock`), the stability options that pick or drop rows (`stability`),
the kept-set replay that keeps vLLM's importance weights unbiased under truncated sampling (`sampling_mask`), and the
stop when the sandbox cannot run code (`sandbox_health`, also used by evaluation)."""
