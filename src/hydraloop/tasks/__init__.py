"""Tasks (the `task` config group): what the loop optimises and what validation reports. See base.Task."""
