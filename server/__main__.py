"""`python -m server ...` == `vllm-evict serve ...`."""

from server.cli import main

raise SystemExit(main())
