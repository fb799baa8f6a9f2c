import sys

from ragkv.cli.main import main

sys.exit(main())
