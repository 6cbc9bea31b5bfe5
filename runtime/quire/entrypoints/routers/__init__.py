"""One APIRouter per endpoint family; api_server.build_app includes them all."""
