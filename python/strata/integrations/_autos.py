"""The "auto" values transformers and accelerate derive from a model's hidden size h."""

HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size",
                    "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")


def hidden_size_values(h: int) -> dict:
    """{key: value} for HIDDEN_SIZE_KEYS: h*h, 0.9*h*h and 10*h, as both fill them."""
    return dict(zip(HIDDEN_SIZE_KEYS, (h * h, int(0.9 * h * h), 10 * h)))
