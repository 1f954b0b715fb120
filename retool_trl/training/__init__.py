"""What the trainer does with a rollout before and after TRL scores it: the `retool/*` metrics (`metrics`) and the
stability options that pick or drop rows (`stability`)."""
