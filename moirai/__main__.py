import sys

from moirai.cli import main

sys.exit(main())
