"""What the commands load before training: model and dataset names resolved offline (`names`), tokenizers loaded and
checked as TRL loads them (`tokenizers`), and the tiny local models of the CPU runs and tests (`tiny`)."""
