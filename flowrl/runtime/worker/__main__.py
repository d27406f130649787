import sys

from flowrl.runtime.worker.worker import main

sys.exit(main())
