"""deepspeed.ops under strata's name, for scripts whose imports say `from deepspeed.ops.adam import
...`: strata.ops.adam has DeepSpeedCPUAdam and FusedAdam (strata.optim's, run by the engine)."""
