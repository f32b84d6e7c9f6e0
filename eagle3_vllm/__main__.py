"""`<vLLM env python> -m eagle3_vllm --session | --serve HOST:PORT --request REQ.json` (worker.py)."""

import sys

from eagle3_vllm.worker import main

sys.exit(main())
