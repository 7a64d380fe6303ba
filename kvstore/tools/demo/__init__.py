"""``kvstore demo``: a multi-turn chat through the engine (or the store alone), showing blocks move between tiers."""
