"""`pagoda bench serve | throughput | latency` (vLLM's `vllm bench` commands and flag names; `args`), and the
engines they share with tools/: the serving benchmark (`serving`, also tools/bench_serving.py), the offline
workload (`workload`, also tools/bench_throughput.py), the offline benchmarks (`offline`) and their PNGs."""
