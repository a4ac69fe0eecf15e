import sys

from workers.worker import main

sys.exit(main())
