import sys

from pagedllm.cli import main

# Guarded: the server's engine core is a spawned process, which imports this module again.
if __name__ == "__main__":
    sys.exit(main())
