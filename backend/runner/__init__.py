"""Model runners: execute one SchedulerOutput and return the sampled tokens."""
