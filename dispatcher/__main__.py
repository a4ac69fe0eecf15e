import sys

from dispatcher.cli import main

sys.exit(main())
