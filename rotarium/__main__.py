import sys

from rotarium.cli import main

sys.exit(main())
