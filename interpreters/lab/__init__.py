"""The eviction lab: replay traces through block caches or the service itself, sweep policies and capacities."""
