"""`python -m pagellm.executor RANK MASTER_ADDR MASTER_PORT LOCAL_RANKS`: one worker process."""

import sys

from pagellm.executor.worker import worker_main

worker_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
