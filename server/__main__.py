"""`python -m vllm_evict.server ...` == `vllm-evict serve ...`."""

from vllm_evict.server.cli import main

raise SystemExit(main())
