"""Creates the file named by its argument: proof that a worker started."""

import sys

open(sys.argv[1], "w").close()
