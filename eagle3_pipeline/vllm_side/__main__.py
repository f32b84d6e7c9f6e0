"""`<vLLM env python> -m eagle3_pipeline.vllm_side --session | --serve HOST:PORT --request REQ.json`
(worker.py)."""

import sys

from eagle3_pipeline.vllm_side.worker import main

sys.exit(main())
