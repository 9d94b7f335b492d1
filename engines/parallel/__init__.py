"""Where parameters, gradients and optimizer state live: FSDP2 sharding and activation
checkpointing, Ulysses sequence parallelism, host offload and the host optimizer.
"""
