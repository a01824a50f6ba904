"""The models of the course, each declaring its parallel plans (chapters 01 and 12).

``gpt.py``: the course's GPT (chapter 01) and its mixture-of-experts MLP (``moe.py``, chapter 09). A model
declares how each technique applies to it (``refimpl.parallel.declarations``: its tensor-parallel plan,
shard and checkpoint units, pipeline stages, attention and positions for context parallelism); the
techniques under ``refimpl/parallel/`` read those declarations and never import a model, so they take a
user's own module the same way (chapter 12's "bring your own model").
"""

from refimpl.models.gpt import GPT, MLP, CausalSelfAttention, Embedding, TransformerBlock, generate, lm_loss

__all__ = ["GPT", "MLP", "CausalSelfAttention", "Embedding", "TransformerBlock", "generate", "lm_loss"]
