"""Generation across the split: a causal LM's prefill and decode with each layer's KV cache on its own device.

:mod:`~moirai.generation.step` is the step module that is traced once; :mod:`~moirai.generation.engine` runs
sequences through it (slots, chunked prefill, batched decode steps in flight); :mod:`~moirai.generation.lm` is
``compile_lm``, ``CompiledLM.generate`` and the generation server.
"""
