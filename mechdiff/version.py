"""The package's version: part of every stage key (a release that changes results moves it), read by the modules
that key or stamp what they write, and exported as ``mechdiff.__version__``."""

__version__ = "0.1.0"
