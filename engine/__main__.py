import sys

from .cli import main
from .threads import configure_gc, configure_threads

configure_gc()  # fewer garbage collections per step (engine/threads.py)
configure_threads("cli")  # torch's intra-op threads, from the cores actually free (engine/threads.py)
sys.exit(main())
