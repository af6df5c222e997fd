"""Draft length: -k auto's cost model and batch plan, where its acceptance estimates
start, and what it is priced with: step costs and nsd's own per-pass costs measured on
this machine, the CPU they were measured on and the load beside them."""
