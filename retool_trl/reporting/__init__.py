"""What a person sees of a run: the training console (`console`), a run's logs read back (`run_logs`) and its plots
(`plotting`). `run_logs` and `plotting` import neither torch nor TRL."""
