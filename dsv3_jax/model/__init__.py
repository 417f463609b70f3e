"""The DeepSeek-V3 network as Flax NNX modules: layers, rotary embedding, attention and its cache,
MoE, the decoder block, the transformer and the multi-token-prediction module."""
