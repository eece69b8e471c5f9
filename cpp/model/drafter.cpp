// drafter_create: the drafter of a config's architecture (see drafter.h).
#include "model/drafter.h"

#include "model/dflash2_drafter.h"
#include "model/dflash_drafter.h"

namespace dflash {

std::unique_ptr<Drafter> drafter_create(const DraftConfig& config, const std::string& draft_dir, Backend& backend,
                                        const Transformer& target, const std::string& target_dir) {
  if (config.arch == DraftArch::kDFlash) {
    return std::make_unique<DFlashDrafter>(config, draft_dir, backend, target, target_dir);
  }
  return std::make_unique<DFlash2Drafter>(config, draft_dir, backend, target, target_dir);
}

}  // namespace dflash
