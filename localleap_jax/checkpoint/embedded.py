"""The small models shipped inside the package (localleap_jax/assets), by the names `ll.load` takes for them."""

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# The small model trained by experiments/train_tiny.py on GSM8K-format arithmetic.
EMBEDDED = ASSETS / "tiny-math"
EMBEDDED_SDAR = ASSETS / "tiny-math-sdar"  # its block-diffusion twin
EMBEDDED_DG = ASSETS / "tiny-math-dg"  # its DiffusionGemma twin (uniform-noise canvas, encoder-decoder)
# Trained on six-step chains (synthetic_math's chain6), where committing a step's result before the step it
# builds on costs accuracy.
EMBEDDED_CHAIN = ASSETS / "tiny-chain"
EMBEDDED_MODELS = {"embedded": EMBEDDED, "embedded-sdar": EMBEDDED_SDAR, "embedded-chain": EMBEDDED_CHAIN,
                   "embedded-dg": EMBEDDED_DG}
