"""What a person sees of a run: the training console (`console`), a run's logs read back (`run_logs`) and its plots
(`plotting` lays out and saves a figure of the `panels`, each drawn by `panel_drawing`). `run_logs` and the plotting
modules import neither torch nor TRL."""
