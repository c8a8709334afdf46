"""The wire, the aiohttp syncer server, the async client."""
