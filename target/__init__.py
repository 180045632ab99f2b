"""The target side: the target model (loading, hashes, hidden-state capture), the vLLM engine settings
every stage serves it with, vLLM's logs, and the processes a stage starts and the reaper that stops them."""
