"""The C extensions, each beside its numpy fallback: float16 conversions
(:mod:`.half`, ``_half.c``) and the fused optimizer updates (``_optim.c``, whose
fallbacks are the update rules of :mod:`mpitrain.models.optim`). Both are optional: a
machine without a compiler installs and trains with numpy, to the same bits."""
