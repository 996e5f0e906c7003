"""The vendor backends. Importing each registers it with ``turboquant.registry``; none builds
or loads anything at import (each compiles or finds its library on first use), so importing
works on any machine, and ``turboquant.backends()`` says per backend why it can't run here."""
from . import aiter, cuda, sm120  # noqa: F401
