"""The engine: request state, block manager, scheduler, model runner, sampler and the engine loop."""
