import sys

from quillcache.cli import main

sys.exit(main())
