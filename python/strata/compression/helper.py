"""deepspeed.compression.helper's module-path helpers, which DeepSpeed-Chat's LoRA code imports
(`from deepspeed.compression.helper import recursive_getattr, recursive_setattr`)."""


def recursive_getattr(model, module_name: str):
    """The attribute at the dotted path `module_name` under `model` ("layers.0.mlp")."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name: str, module) -> None:
    """Sets the attribute at the dotted path `module_name` under `model` to `module`."""
    *parents, last = module_name.split(".")
    output = model
    for name in parents:
        output = getattr(output, name)
    output.__setattr__(last, module)
