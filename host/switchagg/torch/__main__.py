"""``python -m switchagg.torch``: compile the C++ c10d backend for the installed torch ahead of its
first use (a Docker image, a cluster's shared home) and print where the library is (native.py)."""

import sys

from switchagg.torch import native

sys.exit(native.main())
