import sys

from pagedllm.cli import main

# Guarded: importing this module (as multiprocessing's spawn does) must not run the CLI.
if __name__ == "__main__":
    sys.exit(main())
