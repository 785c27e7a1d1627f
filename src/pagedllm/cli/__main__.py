import sys

from pagedllm.cli.main import main

sys.exit(main())
