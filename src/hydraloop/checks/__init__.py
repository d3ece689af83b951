"""The launcher's checks: what a command gets wrong is one line naming the key and the value (a ConfigError, exit 2),
before any rank starts and before the run directory is touched. In the order a command meets them:

- command_line: the command line's overrides, before Hydra composes them; with `-m`, sweeps: the sweep or search,
  and each of its jobs checked as the launcher checks one; composition: Hydra's and OmegaConf's refusals while
  composing and resolving, said as one line;
- config_values: the composed config's required values, keys and ranges, and how the global batch splits;
- launch: all of a job's checks in the launcher (`check_launch`), with data_and_task: the data sets built, the task's
  fit to the data, model, optimizers and metrics, and a trial batch through them (hydraloop.trial).

The nodes built with `instantiate` are checked against their `_target_`s in hydraloop.arguments, the strategy's
launch in its own `check`, and the checkpoint to resume in hydraloop.resume.
"""
