"""deepspeed.compression: the helpers scripts import from it (strata runs no compression)."""
