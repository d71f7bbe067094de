"""Scrape collector: vLLM and SGLang servers' `/metrics`, read into the contract's names.

- `fetch`: one bounded scrape (deadline, size limit) and prometheus_client's parser;
- `table`: the mapping, one row per source family, per engine kind;
- `collector`: `ScrapeCollector` (registered as "scrape"), each endpoint judged on its own.
"""
from ac_observe.collectors.scrape.collector import ScrapeCollector

__all__ = ["ScrapeCollector"]
