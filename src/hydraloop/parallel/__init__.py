"""Parallelism strategies: each a small module behind one small interface (see single.SingleDevice).

A strategy answers two questions. In the launching process: how does the job start its ranks (`launch`)?
In each rank: which device, how is the model built and wrapped, and how are metrics reduced (`setup`, `build`,
`wrap`, `all_reduce`)?
And, where a wrapper shards the model, how its state goes into and out of a checkpoint (`state_dicts`,
`load_model_state`, `load_optimizer_state`).
The training loop only talks to this interface, so it never branches on the strategy.
"""
