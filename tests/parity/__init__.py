"""The engine's tokens and logits against transformers on the real embedded model: float32 exactly
(``test_parity.py``), int4/int8 within the measured rounding noise (``test_parity_quant.py``).

Minutes of compute on 2 cores (a transformers reference per prompt and weight format), so they are
not in the ``tests/unit`` loop (``make test-unit``); ``make test`` runs them, and
``scripts/gpu_check.sh`` runs ``test_parity.py`` on CUDA (``LIFECYCLE_TEST_DEVICE=cuda``).
"""
