"""Stage logic for realloop: plain, typed functions that never import the orchestrator."""
