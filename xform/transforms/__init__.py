"""Built-in transforms, one module each. Importing this package registers their spec names."""

from xform.transforms.cast import Cast, LowPrecisionWeight

__all__ = ["Cast", "LowPrecisionWeight"]
