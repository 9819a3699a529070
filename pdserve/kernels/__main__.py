import sys

from pdserve.kernels import main

sys.exit(main())
